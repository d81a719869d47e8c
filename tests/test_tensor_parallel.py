"""Tensor parallelism (`dist.tp`): exactness against one process, checkpoints both ways,
refusals.

Every run goes through the command (torchrun with gloo on CPU, warm ranks: tests/ranks.py)
and is compared with the same configuration on one process, which never touches
engine/parallel/tensor.py. The
transformers Llama is split by its config's own `base_model_tp_plan` (attention and MLP); the
in-tree GPT by its plan (heads through its fused q/k/v projection, split third by third, and
the MLP; its row-split projections keep a replicated bias: the gradient norm must count it
once). Documents of different lengths, padded per micro-batch,
make the item counts differ between micro-batches.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import read_metrics, train_records
from tests.ranks import explain, launch_all
from tests.test_pipeline import (
    EXIT_USER_ERROR,
    TRAIN_KEYS,
    assert_close,
    assert_equal,
    checkpoint,
    ok,
    python,
    torchrun,
    val_records,
)

pytest.importorskip("transformers")

COMMON = [
    "logger=none",
    "data.block_size=32",
    "data.packed=false",
    "train.micro_batch_size=4",
    "train.max_steps=4",
    "train.log_every=1",
    "eval.every_steps=2",
    "eval.max_batches=2",
    "eval.sample_tokens=0",
    "scheduler.warmup_steps=2",
    "checkpoint.every_steps=2",
]
LLAMA = ["model=hf_llama", *COMMON]
GPT = ["model=gpt_tiny", "model.n_layer=4", *COMMON]
ACCUM4 = ["train.grad_accum_steps=4"]  # global batch 16 on one data-parallel replica
# 4 ranks: 2 data-parallel replicas x 2 tensor-parallel ranks, FSDP2 over the replicas.
GPT_2D = ["train.grad_accum_steps=2", "dist.tp=2", "dist.strategy=fsdp"]
STEPS = list(range(1, 5))
TIMEOUT = 420.0


class Runs:
    def __init__(self, root: Path, procs: dict[str, subprocess.CompletedProcess]) -> None:
        self.root, self.procs = root, procs

    def dir(self, name: str) -> Path:
        return self.root / name

    def records(self, name: str) -> list[dict]:
        return read_metrics(self.dir(name))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("tp_runs")
    cmds = {
        "llama_ref": python([*LLAMA, *ACCUM4]),
        "llama_tp2": torchrun(2, [*LLAMA, *ACCUM4, "dist.tp=2"]),
        # 2 data-parallel replicas x 2 tensor-parallel ranks, accumulation 2: global batch 16;
        # sharded (DCP) checkpoints of the tensor-parallel shards.
        "llama_tp2_dp2": torchrun(
            4, [*LLAMA, "train.grad_accum_steps=2", "dist.tp=2", "checkpoint.format=sharded"]
        ),
        # 2-D: FSDP2 over the 2 data-parallel ranks on top of the tensor-parallel split.
        "llama_tp2_fsdp2": torchrun(
            4, [*LLAMA, "train.grad_accum_steps=2", "dist.tp=2", "dist.strategy=fsdp"]
        ),
        "gpt_ref": python([*GPT, *ACCUM4]),
        "gpt_tp2": torchrun(2, [*GPT, *ACCUM4, "dist.tp=2"]),
        # Sequence parallelism: padded documents of any length split over the 2 ranks.
        "gpt_tp2_sp": torchrun(2, [*GPT, *ACCUM4, "dist.tp=2", "dist.tp_sequence_parallel=true"]),
        # FSDP2 on top of the fused q/k/v split: its weight sharded over dp on dim 1.
        "gpt_tp2_fsdp2": torchrun(4, [*GPT, *GPT_2D]),
        # 3-D mesh, pp=2 x dp=1 x tp=2: each pipeline stage split over 2 ranks.
        "gpt_pp2_tp2": torchrun(4, [*GPT, *ACCUM4, "dist.pp=2", "dist.tp=2"]),
        # 4 heads over 4 ranks: one head each (and a quarter of the MLP).
        "gpt4_ref": python([*GPT, *ACCUM4, "model.n_head=4"]),
        "gpt4_tp4": torchrun(4, [*GPT, *ACCUM4, "model.n_head=4", "dist.tp=4"]),
    }
    cmds = {n: [*c, f"hydra.run.dir={root / n}"] for n, c in cmds.items()}
    procs = launch_all(cmds, TIMEOUT, TMPDIR=str(root))
    for proc in procs.values():
        ok(proc)
    return Runs(root, procs)


def check_against(got: list[dict], want: list[dict], steps: list[int] = STEPS) -> None:
    """Train records at `steps` and the validation records among them, within 1e-5."""

    def pick(records: list[dict]) -> list[dict]:
        return [r for r in records if r["step"] in steps]

    assert_close(pick(train_records(got)), pick(train_records(want)), TRAIN_KEYS, steps)
    want_val = pick(val_records(want))
    val_steps = [r["step"] for r in want_val]
    assert_close(pick(val_records(got)), want_val, ("val/loss", "val/items"), val_steps)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("name", "ref"),
    [
        ("llama_tp2", "llama_ref"),
        ("llama_tp2_dp2", "llama_ref"),
        ("llama_tp2_fsdp2", "llama_ref"),
        ("gpt_tp2", "gpt_ref"),
        ("gpt_tp2_sp", "gpt_ref"),
        ("gpt_pp2_tp2", "gpt_ref"),
        ("gpt_tp2_fsdp2", "gpt_ref"),
        ("gpt4_tp4", "gpt4_ref"),
    ],
)
def test_tensor_parallel_trains_like_one_process(runs: Runs, name: str, ref: str) -> None:
    """Loss, gradient norm (every step) and validation loss and item count agree within 1e-5:
    items counted per data-parallel replica, not once per tensor-parallel rank; the norm adds
    the shards' squares over every mesh dimension they are split along (FSDP2's strided
    shards of a tensor-parallel split too) and counts whole (and replicated) parameters
    once."""
    check_against(runs.records(name), runs.records(ref))
    assert "DTensor" not in runs.procs[name].stderr


@pytest.mark.multiproc
def test_checkpoints_move_between_tensor_parallel_and_one_process(
    runs: Runs, tmp_path: Path
) -> None:
    """The tp=2 step-2 checkpoint continues on one process and on tp=2 again (bit for bit
    with the uninterrupted tp=2 run), and the one-process checkpoint continues on tp=2. The
    GPT's tp=2 x FSDP2 checkpoint (its fused q/k/v weight gathered from 2-D shards) continues
    on one process, and the one-process checkpoint continues as tp=2 x FSDP2. The sharded
    (DCP) checkpoint of tp=2 x dp=2 continues on one process. The pp=2 x
    tp=2 checkpoint (gathered from stages split over tensor-parallel ranks) continues on one
    process."""
    llama_2d, gpt_2d = (
        checkpoint(runs.dir("llama_tp2_fsdp2"), 2),
        checkpoint(runs.dir("gpt_tp2_fsdp2"), 2),
    )
    cmds = {
        "to_one": python(
            [*LLAMA, *ACCUM4, f"checkpoint.resume={checkpoint(runs.dir('llama_tp2'), 2)}"]
        ),
        "to_tp2": torchrun(
            2,
            [
                *LLAMA,
                *ACCUM4,
                "dist.tp=2",
                f"checkpoint.resume={checkpoint(runs.dir('llama_tp2'), 2)}",
            ],
        ),
        "from_2d": python([*LLAMA, *ACCUM4, f"checkpoint.resume={llama_2d}"]),
        "from_sharded": python(
            [*LLAMA, *ACCUM4, f"checkpoint.resume={checkpoint(runs.dir('llama_tp2_dp2'), 2)}"]
        ),
        "from_one": torchrun(
            2,
            [
                *LLAMA,
                *ACCUM4,
                "dist.tp=2",
                f"checkpoint.resume={checkpoint(runs.dir('llama_ref'), 2)}",
            ],
        ),
        "gpt_from_2d": python([*GPT, *ACCUM4, f"checkpoint.resume={gpt_2d}"]),
        "gpt_from_pp_tp": python(
            [*GPT, *ACCUM4, f"checkpoint.resume={checkpoint(runs.dir('gpt_pp2_tp2'), 2)}"]
        ),
        "gpt_to_2d": torchrun(
            4, [*GPT, *GPT_2D, f"checkpoint.resume={checkpoint(runs.dir('gpt_ref'), 2)}"]
        ),
    }
    cmds = {n: [*c, f"hydra.run.dir={tmp_path / n}"] for n, c in cmds.items()}
    procs = launch_all(cmds, TIMEOUT, TMPDIR=str(tmp_path))
    later = [3, 4]
    for name in cmds:
        ok(procs[name])
        assert "at step 2" in procs[name].stdout, explain(procs[name])
        ref = "gpt_ref" if name.startswith("gpt") else "llama_ref"
        check_against(read_metrics(tmp_path / name), runs.records(ref), later)
    same = [r for r in read_metrics(tmp_path / "to_tp2") if r["step"] > 2]
    want = [r for r in runs.records("llama_tp2") if r["step"] > 2]
    assert_equal(same, want, ("train/loss", "train/grad_norm", "val/loss"))


REFUSE = ["logger=none", "train.max_steps=2", "eval.every_steps=0", "checkpoint.every_steps=0"]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("tp_refusals")
    cmds = {
        "one_process": python(["model=gpt_tiny", *REFUSE, "dist.tp=2"]),
        "heads": torchrun(
            2, ["model=hf_llama", *REFUSE, "dist.tp=2", "model.config.num_key_value_heads=1"]
        ),
        "sequence_with_pp": torchrun(
            2,
            ["model=gpt_tiny", *REFUSE, "dist.tp=2", "dist.pp=2", "dist.tp_sequence_parallel=true"],
        ),
        "sequence_parallel": torchrun(
            2, ["model=hf_llama", *REFUSE, "dist.tp=2", "dist.tp_sequence_parallel=true"]
        ),
        "sequence_no_tp": python(["model=gpt_tiny", *REFUSE, "dist.tp_sequence_parallel=true"]),
        "no_plan": torchrun(2, ["experiment=digits", *REFUSE, "dist.tp=2"]),
        "sam": torchrun(2, ["model=gpt_tiny", *REFUSE, "dist.tp=2", "step=sam"]),
        # The GPT's fused q/k/v split is a strided DTensor, which DCP cannot save.
        "sharded": torchrun(
            2, ["model=gpt_tiny", *REFUSE, "dist.tp=2", "checkpoint.format=sharded"]
        ),
    }
    cmds = {n: [*c, f"hydra.run.dir={root / n}"] for n, c in cmds.items()}
    return launch_all(cmds, TIMEOUT, TMPDIR=str(root))


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("name", "key", "hint"),
    [
        ("one_process", "dist.tp", "--nproc_per_node=2"),
        ("heads", "dist.tp", "num_key_value_heads=1"),
        ("sequence_with_pp", "dist.tp_sequence_parallel", "dist.pp > 1"),
        ("sequence_parallel", "dist.tp_sequence_parallel", "sequence_parallel_plan()"),
        ("sequence_no_tp", "dist.tp_sequence_parallel", "needs dist.tp > 1"),
        ("no_plan", "dist.tp", "tensor_parallel_plan"),
        ("sam", "step", "accumulate"),
        ("sharded", "checkpoint.format", "strided DTensor"),
    ],
)
def test_refusals(
    refusals: dict[str, subprocess.CompletedProcess], name: str, key: str, hint: str
) -> None:
    """One paragraph naming the key and what would work, the user-error exit code."""
    proc = refusals[name]
    assert proc.returncode != 0, explain(proc)
    err = "\n".join(ln for ln in proc.stderr.splitlines() if ln.startswith("error:"))
    assert f"invalid config `{key}`" in err, explain(proc)
    assert hint in err, explain(proc)
    if name in ("one_process", "sequence_no_tp"):
        assert proc.returncode == EXIT_USER_ERROR, explain(proc)
    else:
        assert f"(exitcode: {EXIT_USER_ERROR})" in proc.stderr, explain(proc)


@pytest.mark.multiproc
def test_export_of_a_2d_checkpoint_reloads_in_transformers(runs: Runs, tmp_path: Path) -> None:
    """scripts/export_hf.py on the tp=2 x FSDP2 run's checkpoint (gathered from 2-D shards):
    `from_pretrained` loads it, and its mean loss over the evaluation batches equals
    `trainer.evaluate`'s on the checkpoint (both over the same items)."""
    import sys

    import torch
    import transformers
    from omegaconf import OmegaConf

    from tests.conftest import compose_config
    from tests.ranks import launch, run_cli
    from trainer.run.assemble import build_data

    ckpt = checkpoint(runs.dir("llama_tp2_fsdp2"), 4)
    out = tmp_path / "exported"
    export = launch([sys.executable, "scripts/export_hf.py", f"checkpoint={ckpt}", f"out={out}"])
    assert export.returncode == 0, explain(export)
    evaluated = run_cli([f"checkpoint={ckpt}"], module="trainer.evaluate")
    assert evaluated.returncode == 0, explain(evaluated)
    want = json.loads(evaluated.stdout.strip().splitlines()[-1])

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = compose_config([*LLAMA, *ACCUM4])
    data, _ = build_data(OmegaConf.to_container(cfg.data, resolve=True))
    n = 2 * 16  # eval.max_batches x eval.batch_size (its default)
    total, count = 0.0, 0
    with torch.no_grad():
        for sample in (data.val[i] for i in range(n)):  # a document's token ids
            logits = model(input_ids=sample[None, :-1]).logits[0]
            loss = torch.nn.functional.cross_entropy(logits, sample[1:], reduction="sum")
            total += float(loss)
            count += len(sample) - 1
    assert count == want["val/items"], (count, want)
    assert abs(total / count - want["val/loss"]) <= 1e-5, (total / count, want["val/loss"])


@pytest.mark.multiproc
def test_dropout_sigkill_then_rerun_continues_bit_for_bit(tmp_path: Path) -> None:
    """With dropout and sequence parallelism (each rank draws the masks of its own tokens
    and heads), a tp=2 run SIGKILLed on rank 1 after step 3 (checkpoint at 2) and rerun with
    the same command logs the uninterrupted run's records exactly: every rank's random
    streams come back with the checkpoint."""
    from tests.ranks import launch
    from tests.test_checkpoint import kill_at, resumed_steps

    args = [*GPT, *ACCUM4, "model.dropout=0.1", "dist.tp=2", "dist.tp_sequence_parallel=true"]
    whole, run_dir, marker = tmp_path / "whole", tmp_path / "run", tmp_path / "killed"
    procs = launch_all(
        {
            "whole": torchrun(2, [*args, f"hydra.run.dir={whole}"]),
            "killed": torchrun(2, [*args, f"hydra.run.dir={run_dir}", *kill_at(3, marker, 1)]),
        },
        TIMEOUT,
        TMPDIR=str(tmp_path),
    )
    ok(procs["whole"])
    assert procs["killed"].returncode != 0 and marker.exists(), explain(procs["killed"])
    rerun = launch(
        torchrun(2, [*args, f"hydra.run.dir={run_dir}", *kill_at(3, marker, 1)]),
        TIMEOUT,
        tmp=tmp_path,
    )
    ok(rerun)
    assert resumed_steps(rerun) == [2], explain(rerun)
    got, want = read_metrics(run_dir), read_metrics(whole)
    assert [r["step"] for r in train_records(got)] == STEPS
    assert_equal(train_records(got), train_records(want), TRAIN_KEYS)
    assert_equal(val_records(got), val_records(want), ("val/loss",))


def test_fsdp_shards_a_fused_qkv_weight_on_its_input_features() -> None:
    """On one process (a 1-rank mesh): FSDP2 is given the fused q/k/v weight (rows strided over
    `tp`) on dim 1, everything else on its default dim 0; input features that do not divide
    by the data-parallel size are refused with one paragraph."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from engine.parallel.tensor import (
        NotParallelizable,
        check_dp_placements,
        dp_placement,
        fused_colwise,
    )

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        model = nn.ModuleDict({"qkv": nn.Linear(32, 96), "fc": nn.Linear(32, 64)})
        parallelize_module(model, mesh, {"qkv": fused_colwise(3), "fc": ColwiseParallel()})
        places = {name: dp_placement(p) for name, p in model.named_parameters()}
        assert places == {
            "qkv.weight": Shard(1),
            "qkv.bias": None,
            "fc.weight": None,
            "fc.bias": None,
        }
        assert not isinstance(model["qkv"].bias, DTensor)  # whole
        check_dp_placements(model, 4)
        with pytest.raises(NotParallelizable, match=r"qkv\.weight .* 32 input features"):
            check_dp_placements(model, 3)
    finally:
        dist.destroy_process_group()


def test_a_plan_naming_a_module_no_style_splits_is_one_paragraph() -> None:
    """A model whose tensor-parallel plan names a LayerNorm (or a whole block): a paragraph
    naming the module, its type and what the style splits, before torch's bare
    NotImplementedError; its linear layers named instead, the same model is split."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from engine.distributed import DistInfo
    from engine.parallel.tensor import NotParallelizable, TensorParallel

    class Block(nn.Module):
        def __init__(self, plan: dict[str, str]) -> None:
            super().__init__()
            self.plan = plan
            self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

        def tensor_parallel_plan(self) -> dict[str, str]:
            return self.plan

        def forward(self, x):  # pragma: no cover - never run
            return self.down(self.up(self.norm(x)))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        tp = TensorParallel(DistInfo(), mesh)
        with pytest.raises(NotParallelizable) as refused:
            tp.apply(Block({"norm": "colwise", "down": "rowwise"}))
        assert refused.value.key == "dist.tp"
        said = str(refused.value)
        assert "'norm'" in said and "LayerNorm" in said and "Linear and Embedding" in said
        split = tp.apply(Block({"up": "colwise", "down": "rowwise"}))
        assert isinstance(split.up.weight, DTensor)
    finally:
        dist.destroy_process_group()
