"""Expert parallelism (`dist.ep`) for transformers' mixtures: `model=hf_qwen3_moe` and
`model=hf_mixtral` (8 experts top-2, fused 3-D expert weights) split over 2 ranks by
trainer/models/hf_experts.py give the unsplit model's run.

Each family trains 4 steps of one global batch of 24 samples (SGD with momentum, clipping on,
moe.balance=global with large aux and z weights) on one process, the reference, and on 2 ranks
with dist.ep=2 (each rank holds 4 experts of every block; the block's own router chooses,
tokens go all-to-all), and Qwen3-MoE on 4 ranks with ep=2 x FSDP2 (the other parameters
sharded over the 4, each expert on 2 ranks). The ep runs are launched together. Compared:

- every step's loss, clipped grad norm, aux loss and load, and both evaluations (2 ranks),
  to 1e-6 relative;
- the step-1 gradient as the optimizer applies it (each rank's experts joined along the
  expert dimension, FSDP2's shards gathered) and the first weights;
- resume on one process (dist.ep=1) from each ep=2 run's step-2 checkpoint: Qwen3-MoE's DCP
  shards (the default), Mixtral's checkpoint.format=full (experts gathered): the reference's
  steps 3 and 4;
- another transformers mixture (model.family=olmoe, its experts decorated by transformers
  like the two others) under dist.ep=2: step 1 is one process's; an expert count dist.ep=2
  does not divide: one paragraph naming the family's own key (model.config.num_experts,
  model.config.num_local_experts);
- scripts/export_hf.py of the ep=2 run: transformers' own class with every expert, which
  `from_pretrained` loads with the checkpoint's weights and the reference's logits.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import (
    in_tree_model,
    read_metrics,
    stdlib_text,
    train_in_process,
    train_records,
)
from tests.ep_support import assert_split_update, dump, run_args
from tests.ranks import REPO, explain, launch_all, torchrun

E = 8
REL = 1e-6
STEP2 = "checkpoints/step_00000002"
STEP4 = "checkpoints/step_00000004"
KEYS = ("train/loss", "train/grad_norm", "train/moe_aux_loss", "train/moe_load_max")
FAMILIES = ("qwen3_moe", "mixtral")
# The ep=2 run's checkpoint format by family: both of ExpertParallel's ways of saving.
FORMATS = {"qwen3_moe": "auto", "mixtral": "full"}
# The 2-rank ep runs by family, and Qwen3-MoE's ep=2 x FSDP2 on 4 ranks.
EP_RUNS = {"ep2-qwen3_moe": "qwen3_moe", "ep2-mixtral": "mixtral", "fsdp4-qwen3_moe": "qwen3_moe"}
# Each family's key for its expert count, set to 5 (dist.ep=2 does not divide it).
COUNT_KEYS = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts"}


def common(text: Path, family: str) -> list[str]:
    return run_args(text, [f"model=hf_{family}"])


class Runs:
    """The ep=2 launches first (they run while the references train), then the references,
    then the resumes on one process."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.text = stdlib_text(root / "text.txt", 1750)  # 24 samples of 65 tokens
        launches = {
            f"ep2-{f}": torchrun(
                2,
                [
                    *common(self.text, f),
                    "dist.ep=2",
                    f"checkpoint.format={FORMATS[f]}",
                    dump(root / f"ep2-{f}"),
                    f"hydra.run.dir={root / f'ep2-{f}'}",
                ],
            )
            for f in FAMILIES
        }
        # Another transformers mixture (OLMoE: its experts decorated alike), one step.
        olmoe = [*common(self.text, "qwen3_moe"), "model.family=olmoe", "train.max_steps=1"]
        launches["olmoe"] = torchrun(2, [*olmoe, "dist.ep=2", f"hydra.run.dir={root / 'olmoe'}"])
        for f, key in COUNT_KEYS.items():
            five = [*common(self.text, f), f"model.config.{key}=5", "train.max_steps=1"]
            run_dir = root / f"five-{f}"
            launches[f"five-{f}"] = torchrun(2, [*five, "dist.ep=2", f"hydra.run.dir={run_dir}"])
        # 4 ranks, ep=2 x FSDP2; no evaluation (2 validation samples: lockstep needs one a rank).
        fsdp4 = [*common(self.text, "qwen3_moe"), "dist.ep=2", "dist.strategy=fsdp"]
        fsdp4 += ["eval.every_steps=0", "checkpoint.every_steps=0", dump(root / "fsdp4-qwen3_moe")]
        run_dir = root / "fsdp4-qwen3_moe"
        launches["fsdp4-qwen3_moe"] = torchrun(4, [*fsdp4, f"hydra.run.dir={run_dir}"])
        for f in FAMILIES:
            ref = root / f"ref-{f}"
            train_in_process([*common(self.text, f), dump(ref), f"hydra.run.dir={ref}"], ref)
        train_in_process([*olmoe, f"hydra.run.dir={root / 'ref-olmoe'}"], root / "ref-olmoe")
        self.procs = launch_all(launches, timeout=600)
        for name, proc in self.procs.items():
            assert proc.returncode == 0 or name not in (*EP_RUNS, "olmoe"), explain(proc)
        for f in FAMILIES:  # ep=2 -> one process, from the step-2 checkpoint
            resumed = root / f"from-ep2-{f}"
            shutil.copytree(root / f"ep2-{f}" / STEP2, resumed / STEP2)
            train_in_process([*common(self.text, f), f"hydra.run.dir={resumed}"], resumed)

    def records(self, name: str) -> list[dict[str, Any]]:
        return train_records(read_metrics(self.root / name))

    def dumped(self, name: str, rank: int) -> dict[str, Any]:
        return torch.load(self.root / name / f"step1.pt.rank{rank}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    pytest.importorskip("transformers")
    return Runs(tmp_path_factory.mktemp("ep_hf"))


def assert_same_records(got: list[dict], want: list[dict], steps: list[int]) -> None:
    got_by_step = {r["step"]: r for r in got}
    want_by_step = {r["step"]: r for r in want}
    assert sorted(got_by_step) == steps
    for step in steps:
        for key in KEYS:
            assert got_by_step[step][key] == pytest.approx(want_by_step[step][key], rel=REL), (
                step,
                key,
            )


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


@pytest.mark.multiproc
@pytest.mark.parametrize("name", EP_RUNS)
def test_two_expert_ranks_are_one_process(runs: Runs, name: str) -> None:
    """ep=2 on 2 ranks, and Qwen3-MoE's ep=2 x FSDP2 on 4: every step's loss, clipped grad
    norm, moe.balance=global's aux loss and load are one process's to 1e-6 over 4 steps, and
    so are both evaluations on 2 ranks."""
    family = EP_RUNS[name]
    assert_same_records(runs.records(name), runs.records(f"ref-{family}"), [1, 2, 3, 4])
    if name.startswith("fsdp4"):
        return
    val = [r for r in read_metrics(runs.root / name) if "val/loss" in r]
    want = [r for r in read_metrics(runs.root / f"ref-{family}") if "val/loss" in r]
    assert [r["step"] for r in val] == [2, 4] == [r["step"] for r in want]
    for got, ref in zip(val, want):
        assert got["val/loss"] == pytest.approx(ref["val/loss"], rel=REL)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", EP_RUNS)
def test_step_one_update_is_one_process(runs: Runs, name: str) -> None:
    """Step 1's weights and applied gradient: each rank holds half of every block's fused
    expert weights (gate_up_proj, down_proj), joined they are the one process's, to 1e-6 of
    the largest entry; every other parameter (under FSDP2 gathered) is the same on both
    ranks; on 4 ranks, ranks 2 and 3 hold what ranks 0 and 1 do."""
    want = runs.dumped(f"ref-{EP_RUNS[name]}", 0)
    ranks = [runs.dumped(name, r) for r in (0, 1)]
    replicas = [runs.dumped(name, r) for r in (2, 3)] if name.startswith("fsdp4") else []
    experts = assert_split_update(want, ranks, replicas, REL)
    assert len(experts) == 2 * 2  # gate_up_proj and down_proj in each of 2 blocks


@pytest.mark.multiproc
@pytest.mark.parametrize("family", FAMILIES)
def test_ep_checkpoint_resumes_on_one_process(runs: Runs, family: str) -> None:
    """The ep=2 run's step-2 checkpoint (Qwen3-MoE: DCP shards, each expert written once;
    Mixtral: checkpoint.format=full, the experts gathered to rank 0) resumes on one process:
    steps 3 and 4 are the uninterrupted reference's."""
    shards = (runs.root / f"ep2-{family}" / STEP2 / "shards").is_dir()
    assert shards == (FORMATS[family] == "auto")
    assert_same_records(runs.records(f"from-ep2-{family}"), runs.records(f"ref-{family}"), [3, 4])


def run_export(checkpoint: Path, out: Path) -> None:
    """scripts/export_hf.py's `main`, in this process."""
    spec = importlib.util.spec_from_file_location("export_hf", REPO / "scripts" / "export_hf.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([f"checkpoint={checkpoint}", f"out={out}"])


@pytest.mark.multiproc
def test_export_of_an_ep_run_writes_whole_experts(runs: Runs, tmp_path: Path) -> None:
    """scripts/export_hf.py on the ep=2 Qwen3-MoE run (DCP shards of step 4): transformers'
    `Qwen3MoeForCausalLM` loads it with every expert (8 along dim 0), its weights are the
    checkpoint's bit for bit, and its logits are those of the one-process reference's step-4
    weights to 1e-5."""
    import transformers
    from omegaconf import OmegaConf
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from engine.checkpoint import load_checkpoint
    from engine.distributed import DistInfo
    from tests.conftest import compose_config
    from trainer.models.hf import causal_lm

    out = tmp_path / "exported"
    run_export(runs.root / "ep2-qwen3_moe", out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model) is transformers.Qwen3MoeForCausalLM
    exported = model.state_dict()
    experts = [n for n in exported if is_expert(n)]
    assert experts and all(exported[n].shape[0] == E for n in experts), experts
    # The shards read by torch's own converter, not by cumulus.
    dcp_to_torch_save(runs.root / "ep2-qwen3_moe" / STEP4 / "shards", tmp_path / "whole.pt")
    saved = torch.load(tmp_path / "whole.pt")["model"]
    assert set(saved) == set(exported)
    for name, w in saved.items():
        assert torch.equal(exported[name], w), name

    info = DistInfo()
    cfg = OmegaConf.to_container(compose_config(common(runs.text, "qwen3_moe")).model, resolve=True)
    assert isinstance(cfg, dict)
    ref = causal_lm(cfg["family"], cfg["config"]).eval()
    want = load_checkpoint(runs.root / "ref-qwen3_moe" / STEP4, info, checksums=False)
    ref.load_state_dict(want.shared["model"])
    ids = torch.arange(64).remainder(251).view(1, 64)
    with torch.no_grad():
        got, expected = model(ids).logits, ref(ids).logits
    err = ((got - expected).abs().max() / expected.abs().max()).item()
    assert err <= 1e-5, f"logits: relative error {err:.2e}"


@pytest.mark.multiproc
def test_other_decorated_mixtures_split_alike(runs: Runs) -> None:
    """model.family=olmoe under dist.ep=2: its experts (OlmoeExperts) are found by what
    transformers declares of them and split like Qwen3-MoE's, transformers' own forward
    running on each rank's experts; step 1's loss, grad norm, aux loss and load are one
    process's to 1e-6 (before: refused, cumulus reproduced the math of two families only)."""
    assert_same_records(runs.records("olmoe"), runs.records("ref-olmoe"), [1])


@pytest.mark.multiproc
@pytest.mark.parametrize("family", FAMILIES)
def test_an_expert_count_ep_does_not_divide_names_its_key(runs: Runs, family: str) -> None:
    """5 experts under dist.ep=2: one paragraph naming the key the family counts its experts
    in (Qwen3-MoE's model.config.num_experts, Mixtral's model.config.num_local_experts), not
    the in-tree GPT's model.moe.experts."""
    proc = runs.procs[f"five-{family}"]
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, explain(proc)
    error = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(set(error)) == 1, explain(proc)
    want = f"error: invalid config `dist.ep`: must divide model.config.{COUNT_KEYS[family]} (5)"
    assert error[0].startswith(want), explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)


def test_splitting_keeps_a_frozen_base_frozen() -> None:
    """adapter=lora freezes the base before the layout: keeping a rank's slice of the
    experts (dist.ep) makes new parameters, which keep the frozen base's requires_grad, so
    the optimizer still trains the adapters only (before: every expert became trainable).
    transformers' Qwen3-MoE under peft's LoRA, and the in-tree mixture, each split into a
    group of 2 (rank 1 keeps experts 4..7)."""
    pytest.importorskip("peft")
    import peft

    from engine.parallel.expert import ExpertGroup, distribute_experts
    from trainer.models.hf import causal_lm
    from trainer.models.moe import MoE, MoEConfig

    node = in_tree_model("hf_qwen3_moe")
    model = causal_lm(node["family"], node["config"])
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(model, lora)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    mixture = MoE(16, MoEConfig(experts=E, top_k=2, hidden=24), True, 0.0)
    mixture.init_weights(2)  # (torch.empty's memory may hold NaN, never equal to itself)
    mixture.requires_grad_(False)
    for layer in [*model.expert_layers(), mixture.experts.expert_layer()]:
        m = layer.module
        whole = {n: p.detach().clone() for n, p in m.named_parameters() if p.dim() == 3}
        group = ExpertGroup(None, 2, 1, layer.num_experts // 2)  # type: ignore[arg-type]
        kept = distribute_experts(layer, group)
        assert kept and not any(p.requires_grad for p in kept)
        for n, p in m.named_parameters():
            if n in whole:
                assert torch.equal(p, whole[n][4:]), n
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
