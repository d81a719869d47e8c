"""`python -m trainer.plan`: the real run built for a simulated world, checked against real
runs measured by the same tracker (`train.memory_report=true`).

For `gpt_tiny` and a small `hf_llama`, under one process, DDP, FSDP2, `dist.tp=2`,
`dist.pp=2` and `dist.cp=2` (2 ranks), each real run's first two steps are measured on real
tensors; the plan of the same overrides, simulated on fake tensors in this process, must give
every rank's parameter, gradient and optimizer bytes exactly and its peak within 10%. The
one-process and `dist.cp=2` runs are at a real sequence length, 2048 tokens, where attention
dominates activations (a plan that kept a T x T mask the real run never builds was 2.1x).
Then the whole-world properties: FSDP's shards are the model's bytes over the world, the
parameter count is the analytic one, a stage of many blocks extrapolated from 2 and 3 is
the full simulation within 1%, a layout that does not fit says so, the search finds layouts
that do and prints them ranked, impossible layouts are refused as training refuses them,
and what the console shows (every dimension, sizes in MiB under 1 GiB, no 0.0 ms lines,
CUDA's figure for the GPU's memory, a progress line while it works).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import compose_config
from tests.ranks import explain, launch_all, torchrun_cmd
from trainer.config.cli import to_config

STEPS = ["train.max_steps=2", "eval.every_steps=0", "checkpoint.every_steps=0", "logger=none"]
TINY = ["model=gpt_tiny", "train.micro_batch_size=4", "train.grad_accum_steps=2", *STEPS]
LLAMA = ["model=hf_llama", "data.block_size=32", "train.micro_batch_size=2", *STEPS]
LLAMA += ["train.grad_accum_steps=2"]
LAYOUTS = {
    "one": (1, []),
    "ddp": (2, ["dist.strategy=ddp"]),
    "fsdp": (2, ["dist.strategy=fsdp"]),
    "tp": (2, ["dist.tp=2"]),
    "pp": (2, ["dist.pp=2"]),
    "cp": (2, ["dist.cp=2"]),
}
MODELS = {"gpt": TINY, "llama": LLAMA}
# The one-process and context-parallel runs at a real sequence length (micro-batch 1).
LONG = {
    "gpt": ["model.block_size=2048", "train.micro_batch_size=1"],
    "llama": [
        "model.config.max_position_embeddings=2048",
        "data.block_size=2048",
        "train.micro_batch_size=1",
        # As many key as query heads: the kernel this CPU picks is the one CUDA would (fp32
        # grouped-query attention is CUDA's math kernel but this CPU's flash kernel: planned
        # as CUDA runs it, test_attention_is_planned_with_the_kernel_cuda_would_pick).
        "model.config.num_key_value_heads=4",
    ],
}
LONG_LAYOUTS = ("one", "cp")
# Mixtures of experts (8 experts, top 2) on one process: planned with uniform routing.
# (Qwen3-MoE with as many key as query heads: see LONG's note on the attention kernel.)
MOE = {
    "gpt": [*TINY, "+model.moe.experts=8", "+model.moe.top_k=2", "+model.moe.hidden=64"],
    "qwen3": [
        *(arg for arg in LLAMA if arg != "model=hf_llama"),
        "model=hf_qwen3_moe",
        "model.config.num_key_value_heads=4",
    ],
}

# The in-tree mixture's experts split over 2 ranks (dist.ep=2: 4 experts of every block each).
EP2 = ["dist.ep=2"]


def overrides(model: str, layout: str) -> list[str]:
    """The run's overrides: the model's, the layout's, 2048 tokens where the layout is long."""
    long = LONG[model] if layout in LONG_LAYOUTS else []
    return [*MODELS[model], *LAYOUTS[layout][1], *long]


EXACT = ("parameters_bytes", "gradients_bytes", "optimizer_bytes")


def command(nproc: int, args: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "trainer.train", *args]
    return [*torchrun_cmd(nproc), "-m", "trainer.train", *args]


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every model x layout trained for two measured steps (all launched at once): each
    rank's memory_report.json entry."""
    root = tmp_path_factory.mktemp("measured")
    cmds = {}
    for model in MODELS:
        for layout, (nproc, _) in LAYOUTS.items():
            run_dir = root / f"{model}_{layout}"
            args = [*overrides(model, layout), "train.memory_report=true"]
            cmds[f"{model}_{layout}"] = command(nproc, [*args, f"hydra.run.dir={run_dir}"])
    for model, args in MOE.items():
        run_dir = root / f"moe_{model}"
        cmds[f"moe_{model}"] = command(
            1, [*args, "train.memory_report=true", f"hydra.run.dir={run_dir}"]
        )
    run_dir = root / "moe_gpt_ep2"
    cmds["moe_gpt_ep2"] = command(
        2, [*MOE["gpt"], *EP2, "train.memory_report=true", f"hydra.run.dir={run_dir}"]
    )
    results = launch_all(cmds, 600.0, TMPDIR=str(root))
    out = {}
    for name, proc in results.items():
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
        out[name] = json.loads((root / name / "memory_report.json").read_text())["ranks"]
    return out


def plan(overrides: list[str], tmp: Path) -> dict[str, Any]:
    """`python -m trainer.plan` of these overrides, run in this process: plan.json."""
    from trainer.plan import main

    out = tmp / "plan.json"
    main([*overrides, f"plan.out={out}"])
    return json.loads(out.read_text())


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_plan_predicts_the_measured_memory(
    measured: dict[str, list[dict[str, Any]]], model: str, layout: str, tmp_path: Path
) -> None:
    """The simulated rank of each role has the real rank's parameter, gradient and
    optimizer-state bytes exactly and its peak within 10% (the same tracker, fake vs real
    tensors)."""
    nproc, _ = LAYOUTS[layout]
    planned = plan([*overrides(model, layout), f"plan.world={nproc}"], tmp_path)
    real = {r["rank"]: r for r in measured[f"{model}_{layout}"]}
    for role in planned["roles"]:
        for rank in role["ranks"]:
            for key in EXACT:
                assert role[key] == real[rank][key], (rank, key, role[key], real[rank][key])
            ratio = role["peak_bytes"] / real[rank]["peak_bytes"]
            assert 0.9 <= ratio <= 1.1, (rank, role["peak_bytes"], real[rank]["peak_bytes"])


@pytest.mark.multiproc
@pytest.mark.parametrize("model", list(MOE))
def test_plan_predicts_a_mixture_of_experts_memory(
    measured: dict[str, list[dict[str, Any]]], model: str, tmp_path: Path
) -> None:
    """A mixture of experts, the in-tree GPT's or transformers' Qwen3-MoE, is planned (its
    routing, which fake tensors cannot compute, taken as uniform, and said so): every expert's
    parameter, gradient and optimizer bytes exactly, and the peak of its routed tokens'
    activations within 10% of the real run's."""
    planned = plan([*MOE[model], "plan.world=1"], tmp_path)
    (real,) = measured[f"moe_{model}"]
    (role,) = planned["roles"]
    for key in EXACT:
        assert role[key] == real[key], (key, role[key], real[key])
    assert 0.9 <= role["peak_bytes"] / real["peak_bytes"] <= 1.1, (role, real)
    assert planned["moe_routing"].startswith("uniform")


@pytest.mark.multiproc
def test_plan_predicts_expert_parallel_memory_and_traffic(
    measured: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """gpt_tiny's mixture (8 experts top-2, moe.balance=global) with dist.ep=2 on 2 ranks: each
    rank's parameter, gradient and optimizer bytes exactly the real ep=2 run's, its peak within
    10%; its experts' parameter and optimizer bytes (the measured one-process run's, less the
    experts counted from the shapes, subtracted) half the unsplit experts' within 1%; the
    all-to-all is counted on the expert group, the bytes that leave the rank: routed tokens x
    k x width x 4 bytes x 2 (dispatch and combine) x 3 passes (moe.balance=global's routing
    forward, the forward, the backward) x 2 blocks x (ep - 1) / ep, plus the expert counts
    exchanged before each forward's dispatch; and exposed in the step time. DDP's buckets
    (and its all-reduce) hold the dense gradients only: it ignores the experts."""
    planned = plan([*MOE["gpt"], *EP2, "plan.world=2"], tmp_path)
    real = {r["rank"]: r for r in measured["moe_gpt_ep2"]}
    (role,) = planned["roles"]
    assert role["ranks"] == [0, 1]
    for rank in role["ranks"]:
        for key in EXACT:
            assert role[key] == real[rank][key], (rank, key, role[key], real[rank][key])
        ratio = role["peak_bytes"] / real[rank]["peak_bytes"]
        assert 0.9 <= ratio <= 1.1, (rank, role["peak_bytes"], real[rank]["peak_bytes"])
    cfg, _ = to_config(compose_config(MOE["gpt"]))
    width, hidden, layers = cfg.model["n_embd"], cfg.model["moe"]["hidden"], cfg.model["n_layer"]
    experts, k, ep = cfg.model["moe"]["experts"], cfg.model["moe"]["top_k"], 2
    expert_bytes = layers * experts * (2 * width * hidden + hidden + width) * 4
    (unsplit,) = measured["moe_gpt"]
    for key, copies in (("parameters_bytes", 1), ("optimizer_bytes", 2)):  # AdamW: 2 moments
        dense = unsplit[key] - copies * expert_bytes
        for rank in real:
            per_rank = real[rank][key] - dense
            assert abs(per_rank / (copies * expert_bytes / ep) - 1) <= 0.01, (key, rank)
    # DDP ignores the experts: its buckets, and what it all-reduces, are the dense gradients.
    dense = unsplit["parameters_bytes"] - expert_bytes
    assert role["untracked_bytes"] == {"ddp_buckets": dense}, role["untracked_bytes"]
    assert all(real[rank]["untracked"] == {"ddp_buckets": dense} for rank in real), real
    assert role["comm_bytes_per_step"]["allreduce/dp (DDP buckets)"] == dense
    tokens = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.model["block_size"]
    leaving = (ep - 1) / ep
    rows = tokens * k * width * 4 * 2 * 3 * layers * leaving
    counts = 2 * layers * cfg.train.grad_accum_steps * experts * 8 * leaving  # int64 per expert
    comm = role["comm_bytes_per_step"]
    assert comm["alltoall_base/ep"] == rows + counts, comm
    assert not any(key.startswith("alltoall") and "/dp" in key for key in comm), comm
    est = planned["estimate"]
    a2a = est["comm_s"]["alltoall_base/ep"]
    assert a2a > 0 and est["step_time_s"] >= est["compute_s"] + a2a, est
    assert planned["layout"] == "DDP 2 x expert parallel 2"


def test_plan_of_expert_parallel_under_fsdp_counts_the_all_to_all_on_the_expert_group(
    tmp_path: Path,
) -> None:
    """ep=2 x FSDP2 (dist.strategy=fsdp) plans its all-to-all on the expert group, as ep over
    DDP does: `alltoall_base/ep`, exposed in the step time, none of it on dp (it was counted
    as dp traffic hidden behind compute when only ep over DDP named its groups)."""
    planned = plan([*MOE["gpt"], *EP2, "dist.strategy=fsdp", "plan.world=2"], tmp_path)
    (role,) = planned["roles"]
    comm = role["comm_bytes_per_step"]
    assert comm.get("alltoall_base/ep", 0) > 0, comm
    assert not any(key.startswith("alltoall") and "/dp" in key for key in comm), comm
    est = planned["estimate"]
    assert est["step_time_s"] >= est["compute_s"] + est["comm_s"]["alltoall_base/ep"], est


def llama_parameters(cfg: dict[str, int]) -> int:
    """The analytic parameter count of a Llama (untied): embeddings, per layer the attention
    (grouped key/value heads), the gated MLP and two norms, the final norm, the output."""
    h, inter, layers, vocab = (
        cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    )  # fmt: skip
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    return 2 * vocab * h + layers * per_layer + h


def test_fsdp_shards_are_the_models_bytes_over_the_world(tmp_path: Path) -> None:
    """A small Llama under FSDP over a simulated world of 16: the parameter count is the
    analytic one, each rank's parameter bytes the model's bytes / 16 within 1% (padding),
    and the whole world is one role."""
    args = [*LLAMA, "dist.strategy=fsdp", "train.global_batch_size=32", "plan.world=16"]
    planned = plan(args, tmp_path)
    cfg, _ = to_config(compose_config(LLAMA))
    count = llama_parameters(cfg.model["config"])
    assert planned["parameters"] == count
    (role,) = planned["roles"]
    assert role["ranks"] == list(range(16))
    assert abs(role["parameters_bytes"] - 4 * count / 16) <= 0.01 * 4 * count / 16


# Pipeline x FSDP over 4 GPUs, an 8-block GPT: 4 blocks per stage.
DEEP = ["model=gpt_tiny", "model.n_layer=8", "model.block_size=128", *STEPS]
DEEP += ["train.micro_batch_size=1", "train.global_batch_size=2", "plan.world=4"]
DEEP += ["dist.pp=2", "dist.strategy=fsdp"]


def test_a_stage_extrapolated_from_two_and_three_blocks_is_the_full_simulation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every figure of every role of the plan, simulated with 2 and 3 blocks per stage
    and extrapolated to 4, is the full simulation's within 1% (parameter, gradient and
    optimizer bytes exactly; each collective's bytes too). Its console: the header names
    every dimension, sizes under 1 GiB are in MiB, no 0.0 ms line, and a progress line
    says which role and which module it simulates."""
    from trainer.planning import progress

    monkeypatch.setattr(progress, "EVERY", 0.2)
    fast = plan(DEEP, tmp_path)
    shown = capsys.readouterr().out
    full = plan([*DEEP, "plan.full=true"], tmp_path)
    assert fast["how"].startswith("extrapolated from 2 and 3"), fast["how"]
    assert full["how"] == "simulated"
    assert fast["parameters"] == full["parameters"]
    for a, b in zip(fast["roles"], full["roles"], strict=True):
        for key in EXACT:
            assert a[key] == b[key], (a["ranks"], key)
        for key in ("peak_bytes", "activations_bytes"):
            assert abs(a[key] / b[key] - 1) <= 0.01, (a["ranks"], key, a[key], b[key])
        assert a["comm_bytes_per_step"] == b["comm_bytes_per_step"]
    assert abs(fast["estimate"]["step_time_s"] / full["estimate"]["step_time_s"] - 1) <= 0.01
    lines = shown.splitlines()
    header = lines[next(i for i, ln in enumerate(lines) if "|" in ln) - 1]
    assert "pipeline 2 (1f1b) x FSDP 2 on 4 x h100 (79.19 GiB)" in header
    rows = [ln for ln in lines if ln.strip().startswith(("0-1 |", "2-3 |"))]
    assert len(rows) == 2 and all("GiB" not in row and "MiB" in row for row in rows), rows
    assert "0.0 ms" not in shown
    ticks = [ln for ln in lines if ln.startswith("plan: ") and " s  " in ln]
    assert any("role 1/2 (ranks 0-1), 2 blocks per stage: step" in ln for ln in ticks), ticks
    assert any(", forward " in ln or ", backward " in ln for ln in ticks), ticks


# transformers' Qwen3-MoE, 4 layers (the fewest extrapolated), 4 experts, bf16
# (moe.balance=global, the default): its balancing loss over every layer's router logits runs
# outside the blocks, as many ops as layers.
DEEP_MOE = ["model=hf_qwen3_moe", "model.config.num_hidden_layers=4", "train.precision=bf16"]
DEEP_MOE += ["model.config.num_experts=4", *STEPS, "data.block_size=64"]
DEEP_MOE += ["train.micro_batch_size=1", "train.global_batch_size=16", "plan.world=4"]
DEEP_MOE += ["dist.strategy=fsdp", "dist.ep=2"]


def test_a_mixture_extrapolated_from_two_and_three_blocks_is_the_full_simulation(
    tmp_path: Path,
) -> None:
    """A mixture's plan from 2 and 3 blocks and 3 of its 4 micro-batches per step is the full
    simulation's (every block, every micro-batch) within 1%, its traffic exactly. Its
    balancing's ops outside the blocks depend on the block count, so they pair no op of the
    other sample: lined up op by op, the extrapolation said 1.04x the full simulation's peak
    (1.21x at 512 tokens; at Qwen3-30B-A3B's shapes 259 GiB against 102)."""
    fast, full = plan(DEEP_MOE, tmp_path), plan([*DEEP_MOE, "plan.full=true"], tmp_path)
    assert fast["how"].startswith("extrapolated from 2 and 3"), fast["how"]
    for a, b in zip(fast["roles"], full["roles"], strict=True):
        for key in EXACT:
            assert a[key] == b[key], (a["ranks"], key)
        for key in ("peak_bytes", "activations_bytes"):
            assert abs(a[key] / b[key] - 1) <= 0.01, (a["ranks"], key, a[key], b[key])
        assert a["comm_bytes_per_step"] == b["comm_bytes_per_step"]


def test_sizes_and_the_gpus_memory_as_cuda_reports_it() -> None:
    """GiB from 1 GiB up, MiB below; an H100 80GB is 85,029,158,912 bytes, an H200 150,109,
    880,320 (torch.cuda.get_device_properties), not 80e9 / 141e9; a progress line carries
    what the planner does, on its timer."""
    from trainer.planning.gpus import GPUS
    from trainer.planning.progress import Progress
    from trainer.planning.table import size

    assert size(34.18 * 2**30) == "34.18 GiB"
    assert size(2**30 - 2**20) == "1023.0 MiB"
    assert size(921.6 * 2**20) == "921.6 MiB"
    assert GPUS["h100"].memory_bytes == 85_029_158_912
    assert GPUS["h200"].memory_bytes == 150_109_880_320
    out = io.StringIO()
    with Progress(every=0.05, out=out) as progress:
        progress.what = "role 2/4 (ranks 16-31): step 1/2"
        time.sleep(0.3)
    assert "role 2/4 (ranks 16-31): step 1/2" in out.getvalue()


def test_attention_with_dropout_is_planned_as_cudas_fused_kernels_hold_it() -> None:
    """On this CPU, SDPA with dropout falls back to the math kernel (T x T scores, causal and
    dropout masks); the planned GPU's flash / memory-efficient kernels keep none of them: the
    plan's SDPA with dropout runs a fused kernel, as it does without."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer.planning.attention import CudaAttention

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 2, 64, 16)
    with Ops() as cpu:
        F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.1)
    with CudaAttention(), Ops() as planned:
        F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.1)
    assert "aten.tril.default" in cpu.seen  # the CPU's math fallback: a T x T mask
    assert "aten.tril.default" not in planned.seen
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in planned.seen


def test_attention_is_planned_with_the_kernel_cuda_would_pick() -> None:
    """fp32 attention with grouped-query heads (`enable_gqa`): this CPU's flash kernel takes
    it, CUDA's fused kernels do not (flash: fp16/bf16 only; memory-efficient: no grouped heads
    before torch 2.14), so CUDA runs the math kernel and holds the T x T scores (an H200,
    torch 2.11: 272 MiB tracked at 2048 tokens for hf_llama, 30 MiB fused): the plan runs
    math too. In bf16, or with as many key as query heads, a fused kernel: no scores."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer.planning.attention import EFFICIENT_TAKES_GQA, CudaAttention

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    def ops(q: torch.Tensor, k: torch.Tensor, planned: bool, bf16: bool = False) -> set[str]:
        gqa = q.shape[1] != k.shape[1]
        with (
            CudaAttention() if planned else contextlib.nullcontext(),
            torch.autocast("cpu", torch.bfloat16, enabled=bf16),
            Ops() as seen,
        ):
            F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=gqa)
        return seen.seen

    fused, scores = "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten.bmm.default"
    q, grouped, full = (
        torch.randn(1, 4, 64, 16),
        torch.randn(1, 2, 64, 16),
        torch.randn(1, 4, 64, 16),
    )
    assert fused in ops(q, grouped, planned=False)  # this CPU: fused
    planned = ops(q, grouped, planned=True)
    assert (fused in planned) is EFFICIENT_TAKES_GQA and (
        scores in planned
    ) is not EFFICIENT_TAKES_GQA
    assert fused in ops(q, grouped, planned=True, bf16=True)  # CUDA's flash takes bf16 + GQA
    assert fused in ops(q, full, planned=True)  # memory-efficient takes fp32 without GQA
    assert scores in ops(torch.randn(1, 4, 64, 12), torch.randn(1, 4, 64, 12), planned=True)


def test_a_recomputed_block_runs_the_attention_kernel_its_forward_ran(tmp_path: Path) -> None:
    """Activation checkpointing recomputes a block's forward in backward, where the autograd
    engine carries no torch-function mode: an fp32 grouped-query Llama (CUDA's math kernel,
    this CPU's flash kernel) planned with checkpointing stopped with torch's CheckpointError
    (the recomputed forward saved the flash kernel's tensors, not the math kernel's). It
    plans, and checkpointing keeps less than the plan without."""
    plain = plan([*LLAMA, "plan.world=2"], tmp_path)
    recomputed = plan([*LLAMA, "plan.world=2", "model.activation_checkpointing=true"], tmp_path)
    kept = [p["roles"][0]["activations_bytes"] for p in (recomputed, plain)]
    assert 0 < kept[0] < kept[1], kept


def test_a_layout_that_does_not_fit_says_so_and_search_finds_ones_that_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a GPU too small for DDP's replicated state, the plan says it does not fit; with
    plan.search=true it lists layouts that do (fitting ones first, some simulated), and
    prints them ranked as a table: overrides, fits, peak, step time."""
    probe = plan([*TINY, "plan.world=4", "dist.strategy=ddp"], tmp_path)
    ddp_peak = probe["roles"][0]["peak_bytes"]
    small = [f"plan.memory_bytes={int(ddp_peak * 0.8)}", "plan.headroom=0"]
    args = [*TINY, "plan.world=4", "dist.strategy=ddp", "train.global_batch_size=32", *small]
    planned = plan([*args, "plan.search=true"], tmp_path)
    assert not planned["roles"][0]["fits"]
    fitting = [lay for lay in planned["layouts"] if lay["fits"]]
    assert fitting and planned["layouts"][0]["fits"]
    assert any(lay["how"] == "simulated" for lay in fitting)
    assert all(lay["peak_bytes"] <= int(ddp_peak * 0.8) for lay in fitting)
    assert not any("dist.ep" in o for lay in planned["layouts"] for o in lay["overrides"])
    shown = capsys.readouterr().out.splitlines()
    start = [i for i, ln in enumerate(shown) if ln.startswith("layouts: ")][-1]
    assert f"{len(planned['layouts'])} valid, {len(fitting)} fit" in shown[start]
    assert [c.strip() for c in shown[start + 1].split("|")] == [
        *("#", "fits", "peak", "step", "how", "overrides")
    ]
    best = planned["layouts"][0]
    first = [cell.strip() for cell in shown[start + 2].split("|")]
    assert first[:2] == ["1", "yes"] and first[4] == best["how"], first
    assert first[3] == f"{best['step_time_s']:.3f} s" and first[5] == " ".join(best["overrides"])


# gpt_tiny's mixture (8 experts top-2) on 4 GPUs, bf16 (the gathers and the all-to-all in it).
MOE_SEARCH = [*MOE["gpt"], "plan.world=4", "train.precision=bf16"]


def test_search_offers_a_mixture_its_expert_parallel_layouts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mixture's search varies dist.ep over the degrees that divide the world and the
    expert count (1, 2, 4 of 8 experts on 4 GPUs), DDP and FSDP2, and offers none of the
    pipeline, tensor- or context-parallel layouts a mixture refuses (a dense model's names
    no dist.ep: test_a_layout_that_does_not_fit_says_so_and_search_finds_ones_that_do). The
    screening's bytes per collective are those the simulation counts (the all-to-all's less
    the expert counts exchanged before each dispatch)."""
    from trainer.planning import search
    from trainer.planning.gpus import GPUS
    from trainer.planning.plan import plan_run

    monkeypatch.setattr(search, "SIMULATED", 1)  # (simulating layouts: the test above)
    ep2 = [*MOE_SEARCH, "dist.ep=2", "dist.strategy=fsdp", "train.global_batch_size=16"]
    cfg, _ = to_config(compose_config([*ep2, "plan.search=true"]))
    planned = plan_run(cfg)
    found = [dict(o.split("=", 1) for o in lay["overrides"]) for lay in search.search(cfg, planned)]
    assert {d["dist.ep"] for d in found} == {"1", "2", "4"}
    assert {d["dist.strategy"] for d in found} == {"ddp", "fsdp"}
    assert all(d["dist.pp"] == d["dist.tp"] == d["dist.cp"] == "1" for d in found)
    measured = planned.roles[0].comm_bytes
    traffic = search.Traffic(planned, GPUS["h100"], 8, routing_pass=True)  # moe.balance=global
    screened = traffic.comm(cfg.dist.dims(4), ac=False, micro=planned.micro)
    counts = measured["alltoall_base/ep"] - screened.pop("alltoall_base/ep")
    assert 0 <= counts < screened["allgather_base/dp"] / 100, counts
    assert screened == {k: v for k, v in measured.items() if k in screened}, measured


@pytest.mark.launches
@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["model=gpt_tiny", "dist.tp=2", "plan.world=3"], "dist.tp"),
        (["model=hf_llama", "dist.tp=8", "plan.world=8"], "dist.tp"),
        (["model=gpt_tiny", "dist.pp=4", "plan.world=4"], "dist.pp"),
        (["model=gpt_tiny", "plan.gpu=h1000"], "plan.gpu"),
    ],
    ids=["world_not_divisible", "heads", "more_stages_than_blocks", "unknown_gpu"],
)
def test_impossible_layouts_are_refused_as_training_refuses_them(
    args: list[str], key: str, tmp_path: Path
) -> None:
    """One paragraph naming the key, exit 2, the same refusal training gives."""
    cmd = [sys.executable, "-m", "trainer.plan", *args, "logger=none", f"plan.out={tmp_path}/p"]
    proc = launch_all({"plan": cmd}, 300.0)["plan"]
    assert proc.returncode == 2, explain(proc)
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert f"invalid config `{key}`" in line, line
    assert "Traceback" not in proc.stderr


def test_a_non_fused_optimizer_is_planned(tmp_path: Path) -> None:
    """`optim=sgd` (not fused) reads the step's overflow flag on the host, which fake tensors
    do not have: the plan takes the step that updates, and its optimizer state is the
    momentum buffer, one copy of the parameters."""
    got = plan(["model=gpt_tiny", "optim=sgd", "plan.world=2", "plan.gpu=h100"], tmp_path)
    (role,) = got["roles"]
    assert role["fits"] and role["optimizer_bytes"] == role["parameters_bytes"] > 0
