"""Expert parallelism (`dist.ep`): the experts split over ranks give the unsplit model's run.

The tiny mixture of tests/test_moe.py (gpt_tiny, 8 experts top-2 in every block) trains 4
steps of one global batch of 24 samples (SGD with momentum, clipping on, moe.balance=global
with large aux and z weights) on one process, the reference, and on 2 ranks with dist.ep=2
(each rank holds 4 experts of every block; tokens sent all-to-all). Compared:

- on 4 ranks with ep=2 (each expert on 2 ranks) too, under DDP and under FSDP2
  (dist.strategy=fsdp: the other parameters sharded over the 4 ranks, the experts split);
- the records of every step (loss, clipped grad norm, aux loss, load) to 1e-6 relative, also
  with moe.balance=micro and bias, and the evaluations;
- step 1's gradient as the optimizer applies it (each rank's experts joined along the expert
  dimension), and the first weights;
- resume: the ep=2 run killed (SIGKILL) after step 3 resumes from step 2 (full format) on
  one process and on ep=2, the reference's step-2 checkpoint on ep=2, and the 4-rank run's
  (DCP shards, each expert written once) on one process and on 2 ranks, and ep=2 x FSDP2's
  on one process and under FSDP2 without ep: the reference's records;
- memory: each rank's parameter and optimizer bytes are the reference's less half the experts';
- one mixture with every token routed to rank 0's experts (rank 1 receives nothing in both
  all-to-alls): tests/ep_support.py;
- bad input: one paragraph naming dist.ep, or the choice that does not compose with it yet
  (refused from the config in one process, before the world's size or any process group).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TINY, read_metrics, stdlib_text, train_in_process, train_records
from tests.ep_support import assert_split_update, dump, run_args
from tests.ranks import explain, launch_all, torchrun

E, K, HIDDEN = 8, 2, 48
REL = 1e-6
STEP2 = "checkpoints/step_00000002"
KEYS = ("train/loss", "train/grad_norm", "train/moe_aux_loss", "train/moe_load_max")
BALANCES = ("micro", "bias")
MOE = [f"+model.moe.experts={E}", f"+model.moe.top_k={K}", f"+model.moe.hidden={HIDDEN}"]
QUIET = ["eval.every_steps=0", "checkpoint.every_steps=0"]
FP16 = ["train.precision=fp16", "train.max_steps=3", *QUIET]
BF16 = ["dist.strategy=fsdp", "train.precision=bf16", "train.max_steps=1", *QUIET]


def common(text: Path) -> list[str]:
    return run_args(text, MOE)


def overflow(run_dir: Path, rank: int) -> str:
    """fp16: inf in rank `rank`'s last expert gradient at step 1 (tests/moe_support.py)."""
    target = "tests.moe_support.OverflowInExperts"
    return f"+callbacks.overflow={{_target_: {target}, path: {run_dir}/overflow.pt, rank: {rank}}}"


# Refused under dist.ep=2 from the run's choices alone (ParallelDims.check), before the
# world's size or any process group: tested in one process. The key named, what it says.
REFUSED = {
    "compile": (["train.compile=true"], "train.compile", "train.compile=false, or dist.ep=1"),
    "auto": (
        ["train.micro_batch_size=auto", "train.global_batch_size=32"],
        "train.micro_batch_size",
        "set a number (e.g. train.micro_batch_size=4), or dist.ep=1",
    ),
    "per-layer": (
        ["train.grad_norms=per_layer"],
        "train.grad_norms",
        "set train.grad_norms=total, or dist.ep=1",
    ),
    "sam": (
        ["step=sam", "moe=micro"],
        "step",
        "SAMStep is not built with it yet; use step=accumulate, or dist.ep=1",
    ),
    "cached": (
        ["step=cached"],
        "step",
        "CachedStep is not built with it yet; use step=accumulate, or dist.ep=1",
    ),
    "ema": (["callbacks=ema"], "callbacks.ema", "remove callbacks.ema or set dist.ep=1"),
}


def kill(run_dir: Path) -> list[str]:
    return [
        "+callbacks.kill._target_=tests.ckpt_support.KillOnce",
        "+callbacks.kill.step=3",
        "+callbacks.kill.rank=1",
        f"+callbacks.kill.marker={run_dir}/killed",
        f"+callbacks.kill.wait_for={run_dir}/{STEP2}",
    ]


class Runs:
    """The reference, then every launch at once, then the resumes of the killed run."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.text = stdlib_text(root / "text.txt", 1750)  # 24 samples of 65 tokens
        self.by_balance: dict[str, list[dict[str, Any]]] = {}
        args = common(self.text)
        ref = root / "ref"
        self.ref = train_records(
            train_in_process(
                [*args, dump(ref), "train.memory_report=true", f"hydra.run.dir={ref}"], ref
            )
        )
        shutil.copytree(ref / STEP2, root / "from1" / STEP2)
        for balance in BALANCES:
            run_dir = root / f"ref-{balance}"
            self.by_balance[balance] = train_records(
                train_in_process([*args, f"moe={balance}", f"hydra.run.dir={run_dir}"], run_dir)
            )
        ref_fp16 = root / "ref-fp16"
        train_in_process(
            [*args, *FP16, overflow(ref_fp16, 0), f"hydra.run.dir={ref_fp16}"], ref_fp16
        )
        ep2 = ["dist.ep=2"]
        cmds = {
            "ep2": [*args, *ep2, dump(root / "ep2"), "train.memory_report=true"],
            # Full checkpoints (experts gathered); the others' are DCP shards (auto under ep).
            "killed": [*args, *ep2, *kill(root / "killed"), "checkpoint.format=full"],
            "from1": [*args, *ep2],
            **{f"ep2-{b}": [*args, *ep2, f"moe={b}"] for b in BALANCES},
            "dense": [*TINY, f"data.path={self.text}", "train.max_steps=1", *ep2],
            "experts": [*TINY, f"data.path={self.text}", "+model.moe.experts=5", *ep2],
            # Step 1 in bf16 under FSDP2 with ep=2 (and activation checkpointing), and without.
            **{name: [*args, *a, *BF16] for name, a in (("bf16", ep2), ("bf16-fsdp", []))},
        }
        cmds["bf16"].append("model.activation_checkpointing=true")
        # GradScaler's unscale; an overflow in rank 1's experts at step 1, under FSDP2 (whose
        # DTensor unscale also reduces the overflow flag over its mesh) and under DDP.
        cmds["fp16"] = [*args, *ep2, "dist.strategy=fsdp", *FP16, overflow(root / "fp16", 1)]
        cmds["fp16-ddp"] = [*args, *ep2, *FP16, overflow(root / "fp16-ddp", 1)]
        launches = {
            name: torchrun(2, [*a, f"hydra.run.dir={root / name}"]) for name, a in cmds.items()
        }
        # 4 ranks, ep=2: each expert on 2 ranks (replicas), its gradient summed over them.
        four = [*args, *ep2, dump(root / "ep2x4"), f"hydra.run.dir={root / 'ep2x4'}"]
        four.append("eval.every_steps=0")  # 2 validation samples: lockstep needs one a rank
        launches["ep2x4"] = torchrun(4, four)
        # 4 ranks, ep=2 x FSDP2: the other parameters sharded over all 4, the experts split.
        sharded = [*args, *ep2, "dist.strategy=fsdp", "eval.every_steps=0"]
        sharded += [dump(root / "fsdp4"), "train.memory_report=true"]
        launches["fsdp4"] = torchrun(4, [*sharded, f"hydra.run.dir={root / 'fsdp4'}"])
        self.procs = launch_all(launches, timeout=600)
        done = ("ep2", "ep2x4", "fsdp4", "from1", "bf16", "bf16-fsdp", "fp16", "fp16-ddp")
        for name in (*done, *(f"ep2-{b}" for b in BALANCES)):
            assert self.procs[name].returncode == 0, explain(self.procs[name])
        assert self.procs["killed"].returncode != 0, explain(self.procs["killed"])
        assert (root / "killed" / "killed").exists(), explain(self.procs["killed"])
        for name in ("resumed1", "resumed2", "resumed-fsdp"):
            shutil.copytree(root / "killed", root / name)
        resumed1, from4 = root / "resumed1", root / "from4"
        train_in_process([*args, f"hydra.run.dir={resumed1}"], resumed1)
        shutil.copytree(root / "ep2x4" / STEP2, from4 / STEP2)  # 4 ranks, ep=2 -> 1
        shutil.copytree(root / "ep2x4" / STEP2, root / "from4x2" / STEP2)  # -> 2 ranks
        train_in_process([*args, f"hydra.run.dir={from4}"], from4)
        # ep=2 x FSDP2's DCP shards on one process, and under FSDP2 without ep on 2 ranks.
        for name in ("fsdp4to1", "fsdp4to2"):
            shutil.copytree(root / "fsdp4" / STEP2, root / name / STEP2)
        fsdp4to1 = root / "fsdp4to1"
        train_in_process([*args, f"hydra.run.dir={fsdp4to1}"], fsdp4to1)
        again = {name: [*args, *ep2] for name in ("resumed2", "from4x2")}
        again["fsdp4to2"] = [*args, "dist.strategy=fsdp"]
        again["resumed-fsdp"] = [*args, *ep2, "dist.strategy=fsdp", "checkpoint.format=full"]
        resumed = launch_all(
            {name: torchrun(2, [*a, f"hydra.run.dir={root / name}"]) for name, a in again.items()},
            timeout=300,
        )
        for proc in resumed.values():
            assert proc.returncode == 0, explain(proc)

    def records(self, name: str) -> list[dict[str, Any]]:
        return train_records(read_metrics(self.root / name))

    def dumped(self, name: str, rank: int, file: str = "step1.pt") -> dict[str, Any]:
        return torch.load(self.root / name / f"{file}.rank{rank}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("ep"))


def assert_same_records(got: list[dict], want: list[dict], steps: list[int]) -> None:
    got_by_step = {r["step"]: r for r in got}
    want_by_step = {r["step"]: r for r in want}
    for step in steps:
        for key in KEYS:
            assert got_by_step[step][key] == pytest.approx(want_by_step[step][key], rel=REL), (
                step,
                key,
            )


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


FOUR = ("ep2x4", "fsdp4")  # 4 ranks, ep=2: under DDP, and under FSDP2


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["ep2", *FOUR])
def test_two_expert_ranks_are_one_process(runs: Runs, name: str) -> None:
    """ep=2 on 2 ranks and on 4 (dp=4: each expert on 2 ranks), and on 4 with FSDP2 sharding
    the other parameters: every step's loss, clipped grad norm, aux loss (moe=global) and
    load are one process's to 1e-6 over 4 steps, and so are both evaluations of ep=2 on 2
    ranks (in lockstep)."""
    assert [r["step"] for r in runs.records(name)] == [1, 2, 3, 4]
    assert_same_records(runs.records(name), runs.ref, [1, 2, 3, 4])
    if name in FOUR:
        return
    val = [r for r in read_metrics(runs.root / name) if "val/loss" in r]
    want = [r for r in read_metrics(runs.root / "ref") if "val/loss" in r]
    assert [r["step"] for r in val] == [2, 4] == [r["step"] for r in want]
    for got, ref in zip(val, want):
        assert got["val/loss"] == pytest.approx(ref["val/loss"], rel=REL)


@pytest.mark.multiproc
@pytest.mark.parametrize("balance", BALANCES)
def test_balancing_is_one_process(runs: Runs, balance: str) -> None:
    """moe.balance=micro and bias under ep=2: the one process's records (the counts are the
    whole step's; bias moves every router alike)."""
    got = runs.records(f"ep2-{balance}")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert_same_records(got, runs.by_balance[balance], [1, 2, 3, 4])


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["ep2", *FOUR])
def test_step_one_update_is_one_process(runs: Runs, name: str) -> None:
    """Step 1's weights and applied gradient: each rank holds half the experts of every
    block, joined they are the one process's, to 1e-6 of the largest entry (under FSDP2 the
    other parameters gathered); on 4 ranks, ranks 2 and 3 hold the same as ranks 0 and 1."""
    want = runs.dumped("ref", 0)
    ranks = [runs.dumped(name, r) for r in (0, 1)]
    replicas = [runs.dumped(name, r) for r in (2, 3)] if name in FOUR else []
    experts = assert_split_update(want, ranks, replicas, REL)
    assert len(experts) == 2 * 4  # fc, proj, fc_bias, proj_bias in each of 2 blocks


@pytest.mark.multiproc
def test_resume_reshards_the_experts(runs: Runs) -> None:
    """Killed after step 3 under ep=2 (a full checkpoint, the experts gathered): resumed
    from step 2 on one process and on ep=2, the 4 steps are the reference's; the reference's
    step 2 resumed on ep=2 (1 -> 2), and the 4-rank ep=2 run's DCP shards on one process and
    on 2 ranks with ep=2, too."""
    for name in ("resumed1", "resumed2"):
        records = runs.records(name)
        assert [r["step"] for r in records] == [1, 2, 3, 4], name
        assert_same_records(records, runs.ref, [1, 2, 3, 4])
    assert (runs.root / "ep2x4" / STEP2 / "shards").is_dir()  # DCP: each expert once
    assert not (runs.root / "killed" / STEP2 / "shards").exists()  # checkpoint.format=full
    for name in ("from1", "from4", "from4x2"):
        records = runs.records(name)
        assert [r["step"] for r in records] == [3, 4], name
        assert_same_records(records, runs.ref, [3, 4])


@pytest.mark.multiproc
def test_full_checkpoints_under_fsdp(runs: Runs) -> None:
    """The killed ep=2 run's full checkpoint resumed under ep=2 x FSDP2 on 2 ranks, saving
    full checkpoints too: the 4 steps and the step-4 evaluation are the reference's, and its
    step-4 checkpoint (the other parameters gathered by FSDP2, the experts over their group)
    holds the reference's step-4 weights and momentum, every expert whole, to 1e-6 of the
    largest entry."""
    records = runs.records("resumed-fsdp")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert_same_records(records, runs.ref, [1, 2, 3, 4])
    val = [r for r in read_metrics(runs.root / "resumed-fsdp") if "val/loss" in r]
    want_val = [r for r in read_metrics(runs.root / "ref") if "val/loss" in r]
    assert val[-1]["step"] == 4 == want_val[-1]["step"]  # evaluated in lockstep
    assert val[-1]["val/loss"] == pytest.approx(want_val[-1]["val/loss"], rel=REL)
    step4 = "checkpoints/step_00000004/state.pt"
    got, want = (torch.load(runs.root / n / step4) for n in ("resumed-fsdp", "ref"))
    assert not (runs.root / "resumed-fsdp" / step4).parent.joinpath("shards").exists()
    pairs = [(n, got["model"][n], w) for n, w in want["model"].items()]
    momenta = want["optimizer"]["state"].items()
    pairs += [
        (n, got["optimizer"]["state"][n]["momentum_buffer"], m["momentum_buffer"])
        for n, m in momenta
    ]
    assert sum(is_expert(n) for n, _, _ in pairs) == 2 * 2 * 4  # weights and momenta
    for name, g, w in pairs:
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=0, atol=REL * w.abs().max().item(), msg=name)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["fsdp4to1", "fsdp4to2"])
def test_sharded_experts_resume_anywhere(runs: Runs, name: str) -> None:
    """The step-2 DCP shards of ep=2 x FSDP2 on 4 ranks (the other parameters sharded over
    4, each expert written once) resumed on one process and under FSDP2 without ep on 2
    ranks: steps 3 and 4 are the reference's."""
    assert (runs.root / "fsdp4" / STEP2 / "shards").is_dir()
    records = runs.records(name)
    assert [r["step"] for r in records] == [3, 4], name
    assert_same_records(records, runs.ref, [3, 4])


@pytest.mark.multiproc
@pytest.mark.parametrize(("name", "ranks", "shards"), [("ep2", 2, 1), ("fsdp4", 4, 4)])
def test_each_rank_holds_half_the_experts(runs: Runs, name: str, ranks: int, shards: int) -> None:
    """memory_report.json: each ep=2 rank's parameter and optimizer (momentum) bytes are half
    the one process's experts' plus the other parameters' (a quarter of them under FSDP2 on
    4 ranks), within 1%."""
    want = runs.dumped("ref", 0)["weights"]
    expert_bytes = sum(w.numel() * w.element_size() for n, w in want.items() if is_expert(n))
    ref = json.loads((runs.root / "ref" / "memory_report.json").read_text())["ranks"][0]
    got = json.loads((runs.root / name / "memory_report.json").read_text())["ranks"]
    assert len(got) == ranks
    for rank in got:
        for key in ("parameters_bytes", "optimizer_bytes"):
            dense = (ref[key] - expert_bytes) / shards
            assert rank[key] - dense == pytest.approx(expert_bytes / 2, rel=0.01), (key, rank)


@pytest.mark.multiproc
def test_bf16_is_fsdp_without_experts_split(runs: Runs) -> None:
    """bf16 under FSDP2 with ep=2 and activation checkpointing: the experts (left out of
    FSDP2) compute with their weights cast to bf16 as FSDP2 casts the others; step 1's loss
    and aux loss are FSDP2's without ep to 1e-6, its grad norm to 1e-4 (each expert's bf16
    gradient is rounded per rank before the fp32 sum, and the ranks' shares differ)."""
    got, want = runs.records("bf16"), runs.records("bf16-fsdp")
    assert [r["step"] for r in got] == [1] == [r["step"] for r in want]
    for key in ("train/loss", "train/moe_aux_loss"):
        assert got[0][key] == pytest.approx(want[0][key], rel=REL), key
    assert got[0]["train/grad_norm"] == pytest.approx(want[0]["train/grad_norm"], rel=1e-4)


FP16_RUNS = ("fp16", "fp16-ddp")  # ep=2 under FSDP2 and under DDP


@pytest.mark.multiproc
@pytest.mark.parametrize("name", FP16_RUNS)
def test_fp16_is_one_process(runs: Runs, name: str) -> None:
    """fp16 (GradScaler) under ep=2 x FSDP2 (unscaling and stepping FSDP2's DTensor shards
    and the plain experts in one optimizer) and under DDP: 3 steps are one process's, whose
    step 1 overflows in expert 7 as rank 1's does (skipped: its loss and aux to 1e-6), step 2
    (the first update) to 1e-6 and step 3 to 1e-5 (fp16 autocast rounds the split step's sums
    differently)."""
    got, want = runs.records(name), runs.records("ref-fp16")
    assert [r["step"] for r in got] == [1, 2, 3] == [r["step"] for r in want]
    for records in (got, want):
        assert [r["train/skipped_steps"] for r in records] == [1, 1, 1]
    for key in ("train/loss", "train/moe_aux_loss"):
        assert got[0][key] == pytest.approx(want[0][key], rel=REL), (1, key)
    for step, rel in ((1, REL), (2, 1e-5)):
        for key in KEYS:
            assert got[step][key] == pytest.approx(want[step][key], rel=rel), (step + 1, key)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", FP16_RUNS)
def test_fp16_overflow_in_one_ranks_experts_skips_every_rank(runs: Runs, name: str) -> None:
    """fp16 under ep=2 (x FSDP2, and DDP), inf in rank 1's expert gradient at step 1 (rank
    0's gradients finite): GradScaler's verdict is agreed (`agree_found_inf`; under FSDP2
    the DTensor unscale reduces it over the mesh too), so both ranks skip the step (no
    optimizer state made, every weight, shard and expert as before) and both halve the loss
    scale, as the one process does; the next steps are its (test_fp16_is_one_process)."""
    want = runs.dumped("ref-fp16", 0, "overflow.pt")
    assert want["stepped"] == 0 and want["after"]["scale"] == want["before"]["scale"] / 2
    for rank in (0, 1):
        got = runs.dumped(name, rank, "overflow.pt")
        assert got["before"]["scale"] == want["before"]["scale"], rank
        assert got["after"]["scale"] == want["after"]["scale"], rank  # halved on both
        assert got["stepped"] == 0, rank  # the optimizer skipped on both
        before, after = got["before"]["weights"], got["after"]["weights"]
        assert before.keys() == after.keys() and any(is_expert(n) for n in before)
        for param, w in before.items():
            assert torch.equal(after[param], w), (rank, param)


@pytest.mark.multiproc
def test_an_empty_split_works() -> None:
    """Every token routed to rank 0's experts: rank 1 sends all and receives nothing; the
    outputs and gradients are the unsplit mixture's (tests/ep_support.py checks)."""
    proc = launch_all({"empty": torchrun(2, [], module="tests.ep_support")}, timeout=120)["empty"]
    assert proc.returncode == 0, explain(proc)
    assert "rank 1: empty split ok" in proc.stdout + proc.stderr, explain(proc)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("name", "key", "says"),
    [
        ("dense", "dist.ep", "(model=hf_qwen3_moe, model=hf_mixtral); set dist.ep=1"),
        ("experts", "dist.ep", "must divide model.moe.experts (5)"),
    ],
)
def test_launched_bad_input_is_one_paragraph(runs: Runs, name: str, key: str, says: str) -> None:
    """What dist.ep=2 refuses once the model is built: a dense model (naming the mixtures the
    split knows, the in-tree GPT's and transformers') and an expert count it does not divide:
    one paragraph naming the key and what is valid."""
    proc = runs.procs[name]
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    error = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(set(error)) == 1, explain(proc)  # one paragraph (one line), the same on any rank
    assert error[0].startswith(f"error: invalid config `{key}`: "), explain(proc)
    assert says in error[0], explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["dist.ep=2"], "dist.ep", "must divide the data-parallel size (1)"),
        (["dist.ep=2", "dist.tp=2"], "dist.ep", "dist.tp=2"),
        (["dist.ep=2", "dist.pp=2"], "dist.ep", "dist.pp=2"),
        (["dist.ep=2", "dist.cp=2"], "dist.ep", "dist.cp=2"),
        (["dist.ep=0"], "dist.ep", "positive"),
        *((["dist.ep=2", *a], key, says) for a, key, says in REFUSED.values()),
    ],
    ids=["ep>dp", "tp", "pp", "cp", "zero", *REFUSED],
)
def test_bad_input_is_one_paragraph(
    overrides: list[str], key: str, says: str, tmp_path: Path
) -> None:
    """Refused from the config alone, before any launch: dist.ep not dividing the one
    process's data-parallel size, with tensor, pipeline or context parallelism (which do not
    compose with it yet), and not positive; and the run's choices that do not compose with
    dist.ep=2 yet (compilation, the automatic micro-batch, per-layer norms, another step, an
    averaged copy of the weights), refused before the world's size or any process group, so
    one process reaches each."""
    from trainer.config.errors import ConfigError

    text = stdlib_text(tmp_path / "text.txt", 1750)
    with pytest.raises(ConfigError) as err:
        args = [*TINY, *MOE, f"data.path={text}", *overrides, f"hydra.run.dir={tmp_path}"]
        train_in_process(args, tmp_path)
    assert err.value.key == key and says in str(err.value) and "\n" not in str(err.value)


def test_ddp_ignores_every_list_it_is_given() -> None:
    """dist.ep's experts and a task's own parameters both reach DDP's ignore list: torch's
    setter replaces the list, so the second caller used to drop the first's names (the
    experts would then be averaged over ranks holding different experts)."""
    from torch import nn

    from engine.parallel.ddp import ignore_in_ddp, ignored_by_ddp, reduced_parameters

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    ignore_in_ddp(model, ["0.weight", "0.bias"])  # as ExpertParallel does for the experts
    ignore_in_ddp(model, ["1.weight"])  # as DataParallel does for a task's own parameters
    assert ignored_by_ddp(model) == {"0.weight", "0.bias", "1.weight"}
    kept = {id(p) for p in reduced_parameters(model)}
    assert kept == {id(model[1].bias), id(model[2].weight), id(model[2].bias)}
