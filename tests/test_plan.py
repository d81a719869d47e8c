"""`python -m trainer.plan`: the real run built for a simulated world, checked against real
runs measured by the same tracker (`train.memory_report=true`).

For `gpt_tiny` and a small `hf_llama`, under one process, DDP, FSDP2, `dist.tp=2`,
`dist.pp=2` and `dist.cp=2` (2 ranks), each real run's first two steps are measured on real
tensors; the plan of the same overrides, simulated on fake tensors in this process, must give
every rank's parameter, gradient and optimizer bytes exactly and its peak within 10%. Then
the whole-world properties: FSDP's shards are the model's bytes over the world, the
parameter count is the analytic one, a layout that does not fit says so, the search finds
layouts that do, and impossible layouts are refused as training refuses them.
"""

from __future__ import annotations

import json
import sys
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
    for model, base in MODELS.items():
        for layout, (nproc, extra) in LAYOUTS.items():
            run_dir = root / f"{model}_{layout}"
            args = [*base, *extra, "train.memory_report=true", f"hydra.run.dir={run_dir}"]
            cmds[f"{model}_{layout}"] = command(nproc, args)
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
    nproc, extra = LAYOUTS[layout]
    planned = plan([*MODELS[model], *extra, f"plan.world={nproc}"], tmp_path)
    real = {r["rank"]: r for r in measured[f"{model}_{layout}"]}
    for role in planned["roles"]:
        for rank in role["ranks"]:
            for key in EXACT:
                assert role[key] == real[rank][key], (rank, key, role[key], real[rank][key])
            ratio = role["peak_bytes"] / real[rank]["peak_bytes"]
            assert 0.9 <= ratio <= 1.1, (rank, role["peak_bytes"], real[rank]["peak_bytes"])


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


def test_a_layout_that_does_not_fit_says_so_and_search_finds_ones_that_do(
    tmp_path: Path,
) -> None:
    """On a GPU too small for DDP's replicated state, the plan says it does not fit; with
    plan.search=true it lists layouts that do (fitting ones first, some simulated)."""
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
